"""Named actors that keep what users name beyond one instance: snapshots and adapters (the directory) and
stored Responses."""
