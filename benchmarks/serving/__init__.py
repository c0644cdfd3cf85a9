"""The server under load (``load``), and its cost model: recorded routing replayed with a price per forward."""
