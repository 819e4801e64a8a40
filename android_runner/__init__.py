"""The native runner: C++17 sources (src/), their CMake project, and the Python driver that
generates, builds and runs it per bundle (build.py; docs/runner.md)."""
