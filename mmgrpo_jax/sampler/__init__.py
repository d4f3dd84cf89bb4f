"""The jitted sampler: `generate` (a whole batch at once), the slot pool both engines decode
with (the KV-cache rows, the extend and decode passes), per-row token sampling, the shape
buckets every jitted shape is drawn from, and the request / completion types (`types`, the one
module here free of JAX)."""
