"""Compatibility layers: other marketplaces' APIs served on this platform's services (above every app, imported by
none; checked by .importlinter)."""
