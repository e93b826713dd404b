"""The engine core: scheduler, KV-cache manager, model runner and the step loop."""
