"""Context parallelism: load-balanced THD partitioning and ring attention."""
