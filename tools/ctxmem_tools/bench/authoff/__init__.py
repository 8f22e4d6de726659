"""The benchmark harness that turns block authenticators off in a service process.

This directory is never imported as a package by ctxmem: ``ctxmem bench --auth-ab`` and
``ctxmem bench pod --auth-ab`` (:mod:`ctxmem_tools.bench.auth_ab`) put it first on the
``PYTHONPATH`` of the services they start, so that Python runs its ``sitecustomize.py``
at interpreter start-up; that module patches
:class:`~ctxmem_common.codecs.blockauth.BlockAuthenticator` only when the harness's
variable (``CTXMEM_BENCH_AUTH_OFF=1``) is set too. A service started any other way never
sees this directory: "authenticators off" is a measurement, never a setting.
"""
