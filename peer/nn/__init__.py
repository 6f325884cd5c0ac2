"""Networks and their data: architectures, records (tabular data), graph extraction, the model store."""
