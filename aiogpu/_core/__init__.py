"""The core: every rule once (futures and the hub that settles them, hazards, submission,
deferral, the watchdog). No driver call, no event loop, no user-facing validation inside."""
