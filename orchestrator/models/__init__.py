"""The built-in models: tiny MLA checkpoints (`tinymodel`) and production-geometry stand-ins
(`standins`)."""
