"""The engine: requests, the scheduler, the step contract, sampling, the model runner and its thread.

Nothing is imported here, so `import localserve.engine.scheduler` stays free of torch.
"""
