"""Cross-replica services and the operator/user surface: market, message bus, launcher, Serve app, `pie` CLI."""
