"""On a GPU: the suite one device call runs, and one-off device probes (``probes/``)."""
