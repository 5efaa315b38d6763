"""aqr's tests (a package, so that they import their helpers as ``tests.<module>``)."""
