"""Other serving engines driven from the workbench: SGLang (launch command, client, same trace
schema) in :mod:`workbench.backends.sglang`."""
