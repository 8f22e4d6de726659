"""Data-plane servers: shared memory (fd passing), TCP and RDMA.

- :mod:`.base`: the :class:`~.base.DataServer` contract (lifetime, address, session
  check, connection tracking);
- :mod:`.socket_server`: the accept loop shared by the socket transports;
- :mod:`.shm`, :mod:`.tcp`: the socket transports;
- :mod:`.rdma` (the server), :mod:`.rdma_endpoint` (a session's PD/QP and grant keys),
  :mod:`.rdma_device` (the verbs device context and helpers).
"""
