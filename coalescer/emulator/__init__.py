"""An in-memory emulator of the Taskcluster queue's worker-facing API, for tests and demos."""
