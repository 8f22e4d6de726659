"""gRPC control plane (``ctxmem.v1.ContextMemory``) on grpc.aio."""
