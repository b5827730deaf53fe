"""Discovery: the Registry contract and its backends (embedded, served embedded, etcd)."""
