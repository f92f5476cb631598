"""The pipeline step engine's Lightning side: the driver that runs a LightningModule's steps
through stages (:mod:`.driver`), its entry points (:mod:`.entry`), the user's step code as the
schedule's loss with its logs captured (:mod:`.logs`), and the logs sent to every stage
(:mod:`.log_exchange`)."""
