"""Submitting a chain's jobs to Slurm through submitit: `--folder` checked before anything is submitted, each
job made to wait for the one before it (`afterok`), and a submission that fails half-way (sbatch refused a job,
submitit's files not writable) said in one line that names the jobs submitted before it, and the files submitit
left for the refused job removed."""

from __future__ import annotations

import contextlib
import errno
import io
import os
import re
import uuid
from pathlib import Path

from megatron_ext.cli_types import nearest_existing
from megatron_ext.recipe import RecipeError


FULL = (errno.ENOSPC, errno.EDQUOT)


class SubmissionError(RuntimeError):
    """A job of the chain could not be submitted: one line, saying which jobs were submitted before it."""


class Submitted:
    """The jobs submitted so far, for the line that ends a submission that failed half-way: Slurm runs them as
    submitted (the wording of slurm/pipeline.sh's submit_failed)."""

    def __init__(self) -> None:
        self.jobs: list[tuple[str, str]] = []  # (name, job id)

    def add(self, name: str, job_id: str) -> None:
        self.jobs.append((name, job_id))

    def failed(self, message: str) -> SubmissionError:
        """`message`, then that nothing was launched, or which jobs were and the scancel that cancels them."""
        if not self.jobs:
            return SubmissionError(f"{message}; nothing launched")
        names = ", ".join(f"{name} (job {job})" for name, job in self.jobs)
        return SubmissionError(f"{message}; submitted before it: {names}, which Slurm runs as submitted: scancel "
                               f"{' '.join(job for _, job in self.jobs)} to cancel them")

    def submit(self, executor, name: str, folder: str, function):
        """`executor.submit(function)`, recorded; a refusal of sbatch or a folder it cannot write raises
        SubmissionError (submitit's FailedJobError carried a 30-line traceback, and left the jobs submitted before
        it unsaid), and the files submitit left for the job are removed (`_remove_unsubmitted`)."""
        from submitit.core.utils import FailedJobError, JobPaths

        # The job's pickle and script carry a mark of this submission, so that a refusal removes them and no other
        # launch's (the default --folder is shared, and another may be between its sbatch and its renames).
        mark = f"megatron_ext submission {uuid.uuid4().hex}"
        function.submission_mark = mark
        setup = executor.parameters.get("setup") or []
        executor.update_parameters(setup=[*setup, f"# {mark}"])
        base = JobPaths.get_first_id_independent_folder(folder).absolute()
        before = set(base.iterdir()) if base.is_dir() else set()
        made_from = nearest_existing(base)
        try:
            with contextlib.redirect_stderr(io.StringIO()):  # submitit prints sbatch's stderr itself before it raises
                job = executor.submit(function)
        except FailedJobError as e:
            _remove_unsubmitted(base, mark, made_from)
            code = getattr(e.__cause__, "returncode", None)
            lines = [line.strip().removeprefix("sbatch: error: ") for line in str(e).splitlines()]
            why = "; ".join(line for line in lines if line)
            raise self.failed(f"sbatch refused the {name} job ({why or f'exit {code}'})") from None
        except OSError as e:  # a full or read-only disk: the pickle may be there, empty (its write failed)
            _remove_unsubmitted(base, mark, made_from, empty_since=before)
            fix = "free space there or give another folder" if e.errno in FULL else "give a writable folder"
            raise self.failed(f"--folder {folder}: cannot write submitit's files for the {name} job there "
                              f"({e.strerror or e}); {fix}") from None
        self.add(name, job.job_id)
        return job


# submitit writes a job's pickle and sbatch script under a uuid in --folder's id-independent part, and moves them
# (the script leaving a symlink) into the job's folder once sbatch answered with a job id.
_UNSUBMITTED = re.compile(r"[0-9a-f]{32}\.pkl|\.submission_file_[0-9a-f]{32}\.sh")


def _remove_unsubmitted(base: Path, mark: str, made_from: Path, empty_since: set[Path] | None = None) -> None:
    """Remove the files submitit left in `base` for a job sbatch refused or it could not write (they named no job,
    and piled up with each retry): those under a uuid name, not yet moved, that hold `mark`, or, with
    `empty_since`, that are empty and were not there before. Then the folders made for them (`base` up to
    `made_from`, the part that existed), where empty."""
    if base.is_dir():
        for path in base.iterdir():
            if _UNSUBMITTED.fullmatch(path.name) and not path.is_symlink():
                try:
                    data = path.read_bytes()  # the bytes only: nothing is unpickled
                    if mark.encode() in data or (empty_since is not None and not data and path not in empty_since):
                        path.unlink()
                except OSError:
                    pass  # gone (another launch's, renamed), or unreadable: not ours to judge
    here = base
    while here != made_from and here.is_relative_to(made_from):
        try:
            here.rmdir()
        except OSError:  # not empty (another writer), or gone
            return
        here = here.parent


def check_submit_folder(folder: str) -> None:
    """RecipeError where submitit cannot make `--folder` (its part before the first `%j`): a file there or above it
    ended the submission in a FileExistsError or NotADirectoryError traceback."""
    from submitit.core.utils import JobPaths

    base = JobPaths.get_first_id_independent_folder(folder).absolute()
    there = base
    while not os.path.lexists(there):
        there = there.parent
    if not there.is_dir():
        # a link to nowhere is no file: said as such (it was 'is a file'), with what it points to
        what = f"a link to {os.readlink(there)}, which does not exist" if there.is_symlink() else "a file"
        where = f"is {what}" if there == base else f"lies under {there}, which is {what}"
        raise RecipeError(f"--folder {folder}: {where}, not a folder; give a folder for submitit's logs and pickles")


def after(params: dict, job: str) -> dict:
    """submitit parameters of a job that starts once job `job` has succeeded, and that Slurm cancels if it fails
    (`--kill-on-invalid-dep`: else it would wait in the queue forever, DependencyNeverSatisfied)."""
    extra = dict(params["additional_parameters"], dependency=f"afterok:{job}", kill_on_invalid_dep="yes")
    return dict(params, additional_parameters=extra)
