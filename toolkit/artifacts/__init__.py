"""Writing artifacts safely: the one rule every command that writes follows.

An output (a bundle, an adapter, a trace, an expert store, a model checkpoint, a report) is
- never an input of the same command: not equal to one, inside one or holding one;
- never another kind of artifact: an existing path is replaced only if it is an artifact (or a
  report) of the writer's own kind, recognised by its own marker;
- replaced only with --overwrite;
- written to a temporary path beside it (a file, or a work directory) and renamed into place
  only when complete, so a crash, Ctrl-C or SIGTERM never leaves a half-written artifact under
  the final name, and a full disk becomes one line naming the path.

The package's modules, one job each; each imports only modules listed above it:
- `errors`: OS errors as one line (disk_error, os_error).
- `files`: atomic files (atomic_path, atomic_write_bytes/_text/_with, write_json_atomic,
  special_kind).
- `kinds`: what an existing path is and whether a command may write there (artifact_kind,
  claim_output, check_inputs, KINDS and the artifacts' markers).
- `reports`: single report files under the same rule (report_kind, claim_report, ReportClaim,
  report_claim, release_report_claims, REPORT_KEY, EVENTS_MAGIC, REPORT_SIBLINGS).
- `lock`: the destination lock, a hidden .OUT.lock beside OUT (lock_path).
- `outputs`: output directories and single-file outputs assembled beside OUT and renamed in
  (AtomicDirectory, atomic_directory, atomic_output_file, partial_dir, work_dir, rejected_dir,
  WORK_MARK).
- `hashing`: checksums and config hashes (sha256_file, config_hash).
- `reading`: reading a JSON file as one-line errors (read_json).

Every public name is re-exported here: import them from `toolkit.artifacts`.
"""
from __future__ import annotations

from toolkit.artifacts.errors import disk_error, os_error
from toolkit.artifacts.files import (atomic_path, atomic_write_bytes, atomic_write_text, atomic_write_with,
                                     special_kind, write_json_atomic)
from toolkit.artifacts.hashing import config_hash, sha256_file
from toolkit.artifacts.kinds import (ADAPTER_FORMAT, BUNDLE_FORMAT, KINDS, STORE_MAGIC, TRACE_FORMAT, artifact_kind,
                                     check_inputs, claim_output)
from toolkit.artifacts.cache import being_written, build_once, profile_dir
from toolkit.artifacts.lock import lock_path
from toolkit.artifacts.outputs import (WORK_MARK, AtomicDirectory, atomic_directory, atomic_output_file, partial_dir,
                                       rejected_dir, work_dir)
from toolkit.artifacts.reading import read_json
from toolkit.artifacts.reports import (EVENTS_MAGIC, REPORT_KEY, REPORT_SIBLINGS, ReportClaim, claim_report,
                                       release_report_claims, report_claim, report_kind)

__all__ = [
    "ADAPTER_FORMAT", "BUNDLE_FORMAT", "EVENTS_MAGIC", "KINDS", "REPORT_KEY", "REPORT_SIBLINGS", "STORE_MAGIC",
    "TRACE_FORMAT", "WORK_MARK", "AtomicDirectory", "ReportClaim", "artifact_kind", "atomic_directory",
    "atomic_output_file", "atomic_path", "atomic_write_bytes", "atomic_write_text", "atomic_write_with",
    "being_written", "build_once", "check_inputs", "claim_output", "claim_report", "config_hash", "disk_error",
    "lock_path", "os_error", "partial_dir", "profile_dir", "read_json", "rejected_dir", "release_report_claims",
    "report_claim", "report_kind", "sha256_file", "special_kind", "work_dir", "write_json_atomic",
]
