"""Serving layer (engine, paged cache, batch offline generation). The engine is tracked in issue 7;
until it lands, `kimik3.generate` is the generation entry point."""
