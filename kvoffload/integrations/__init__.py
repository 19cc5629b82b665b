"""Engine integrations: adapters that let an inference engine use kvoffload through the engine's
own extension points. They use the client and the host pool, never the manager or the tiering
library."""
