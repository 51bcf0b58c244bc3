"""The HSA backend: AMD GPUs through ROCr, and the in-process emulator (same code, same ABI).

Its modules here, each with one job:
  runtime.py   HsaRuntime: agents and pools, host locks, copies on SDMA engines, joins as
               barrier-AND packets, memory-fault and watchdog handling, ``describe``
  device.py    HsaDevice: the agent's memory pool, AQL compute queues, kernel dispatches
  memory.py    host arrays locked for the agents (pageable memory, not GTT)
  kernels.py   code objects (hsaco, OpenCL C through comgr, emulated bodies), loading, kernargs
  graph.py     HsaGraphExec: replays as prebuilt AQL packet lists
  signals.py   awaitable HSA signals, the signal pool, the background waiter thread
  queues.py    the AQL packet writer (reserve/publish/doorbell), back-log, kernarg ring,
               copy-engine choice

``aiogpu.signals`` and ``aiogpu.queues`` (the design card's names) are these two modules
under their old names. Beside the core, where the package layout fixes it:
  aiogpu/hsa_bindings/    the HSA ABI in ctypes, and the loader that picks ROCr or the emulator
                          (``hsa_bindings/emulator/``; the core reaches it only through the loader)
"""
