"""The process lifecycle: the supervisor, the run directory, the run spec and endpoint discovery."""
