"""Data-plane servers: shared memory (fd passing) and TCP. RDMA lands separately."""
