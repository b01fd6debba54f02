"""Where inferlets run: one trusted host actor per node, an instance's run and its events, and the sandbox that
confines uploaded code in worker processes."""
