"""The manager process: the tiering library carried over ZeroMQ."""
