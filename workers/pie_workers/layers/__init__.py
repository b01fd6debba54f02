"""Building blocks of the decoder: tensor-parallel linears and embeddings, RMSNorm, RoPE, paged attention."""
