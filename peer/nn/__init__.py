"""Networks and their data: architectures, records (tabular data and images), graph extraction, the model store."""

# image records register their preprocessing kind with peer.nn.tables, so that every reader of a
# stored preprocessing (the model store, pools, the CLI) reads image preprocessings too
from peer.nn import images as images
