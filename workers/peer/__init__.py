"""Peer tier: blocks that other nodes of the fleet hold, found through their node streams
(``follow``, ``index``), fetched from them (``fetch``), and this node's blocks served to them
(``serve``); ``worker`` is the backend."""
