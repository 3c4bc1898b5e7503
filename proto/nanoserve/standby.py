"""How `nanoserve up` keeps a standby worker process (`--standby-workers`): started with its rank's
command line and STANDBY_ENV set, the worker does its imports and waits; the launcher writes GO on its
stdin when the rank it stands by for has died, and the standby goes on as that rank. End of input
without GO: the launcher no longer needs it, and it exits 0. While it waits its process name
(/proc/PID/comm, what `ps` shows) is PROCESS_NAME, which tells it apart from the live rank."""
STANDBY_ENV = "NANOSERVE_WORKER_STANDBY"
GO = b"go\n"
PROCESS_NAME = "worker-standby"
