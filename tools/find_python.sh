#!/bin/sh
# Print the path of a Python <major.minor> interpreter (`make test-py312` uses it): the one on
# PATH if it runs, else pyenv's newest <major.minor>.* install. Exit 1, with a line, if none.
v="$1"
if command -v "python$v" >/dev/null 2>&1 && "python$v" -c '' >/dev/null 2>&1; then
  command -v "python$v"; exit 0
fi
if command -v pyenv >/dev/null 2>&1; then
  found=$(ls -d "$(pyenv root)"/versions/"$v".*/bin/"python$v" 2>/dev/null | sort -V | tail -1)
  if [ -n "$found" ]; then echo "$found"; exit 0; fi
fi
echo "find_python: no Python $v found (on PATH or under pyenv)" >&2
exit 1
