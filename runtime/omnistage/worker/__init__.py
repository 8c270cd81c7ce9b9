"""The stage worker process: one replica of one stage."""
