"""An env that fails at import: `boltzlabs check` must show its start-up output."""

print("import_error env: about to import a module that does not exist", flush=True)

import boltzlabs_no_such_module  # noqa: E402,F401
