"""Writing files so that a reader never sees a half-written one, nor a set of files from two saves.

Every file k3 writes (checkpoints, exports, the lab's results and figures, the unpacked corpus) goes
through this module. Files get the permissions a plain `open()` would give under the user's umask.

One file (`atomic_write`, `write_json`): the content is written under a temporary name in the
target's own folder (the same filesystem, so the final `os.replace` is an atomic rename), flushed to
disk and renamed over the target; the temporary is removed if writing fails or is interrupted.

A set of files (`atomic_write_files`, `move_files_into`: a checkpoint, an export) keeps the names
other programs look for (model.safetensors, config.json, ...) side by side in one folder, so no
single rename can swap it. It is committed through a journal:

1. each new file is written under a temporary name beside its target and flushed (fsync);
2. the journal `.k3-commit.json` is written atomically, listing each temporary -> final name with the
   file's size and sha256: its appearance is the commit point;
3. the temporaries are renamed into place, the manifest `.k3-manifest.json` (the names, sizes and
   hashes, and the checkpoint's step) is written atomically, and the journal is removed. Training
   checkpoints start a manifest; sets written for other programs (`save_pretrained`, an export) do
   not, but keep one already in the folder true to its files. A training checkpoint's manifest is its
   whole set: the files of the previous set that the new one lacks (a whole model.safetensors replaced
   by sharded files, the shards of a save by more processes) are removed at the commit, after the
   renames; only files a manifest listed are ever removed.

A name may lie in a subfolder (`dcp/__0_0.distcp`: the files of torch.distributed.checkpoint, one or
more a process): its temporary is written beside it there. Files written by several processes go
through `shared_staging(folder)`: the folder is locked and recovered, the processes write into a
temporary folder inside it, and the lock holder commits them with `commit_files`, moving each file
(already hashed by the process that wrote it: `described`) into place under the same journal.

The next writer and every reader (through `reading`: every command and loader, their checks included)
first `recover` the folder: a journal means a save died after its commit point, and its renames are
finished (roll forward); without one, the temporaries of a save that died before it are removed. A
kill at any instant therefore leaves the previous set or the new one, never a mix. Readers then
compare the files they read with the manifest (`checked_folder`) and refuse one that differs, naming
it; a folder without a manifest (written before it existed, or by another program) is read as it is.

Writers and readers of one folder take turns through a lock on the folder itself (`folder_lock`:
fcntl.flock of the directory, so no lock file, and it works in a read-only folder), reentrant within
a process: a reader never recovers a folder while a live process is saving into it.

- `staging_folder(beside)`: a fresh temporary folder beside a target, for writers that produce a
  whole folder (transformers' `save_pretrained`, an unpacked archive); removed on exit.

The modules: `atomic` (one file, the folder lock, the staging folder), `journal` (a set of files, its
commit and its recovery), `manifest` (reading a folder, its files checked against the manifest).
"""

from .atomic import (
    CheckpointError,
    Writer,
    atomic_write,
    describe,
    file_mode,
    folder_lock,
    read_json,
    staging_folder,
    temp_beside,
    write_json,
)
from .journal import JOURNAL, MANIFEST, atomic_write_files, commit_files, move_files_into, recover, shared_staging
from .manifest import check_manifest, checked_folder, reading

__all__ = [
    "Writer",
    "JOURNAL",
    "MANIFEST",
    "CheckpointError",
    "file_mode",
    "temp_beside",
    "folder_lock",
    "atomic_write",
    "write_json",
    "read_json",
    "describe",
    "staging_folder",
    "atomic_write_files",
    "commit_files",
    "shared_staging",
    "move_files_into",
    "recover",
    "check_manifest",
    "reading",
    "checked_folder",
]
