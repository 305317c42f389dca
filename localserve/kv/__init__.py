"""The KV pool: the block manager (pure bookkeeping), the paged cache, KV formats, calibration, sizing."""
