"""Runs the docs' Python snippets that tests/test_docs.py hands it, as a reader would: one page's
snippets in order, in one namespace (a later snippet uses what an earlier one made), every page in a
fresh one; on each rank of a torchrun job.

    python -m torch.distributed.run --nproc-per-node 2 tests/support/doc_snippets.py SNIPPETS.json

Each snippet is compiled under its page's name with its own line numbers, so a traceback names the
page and line. Between pages the default group a page made is destroyed, so the next page's
`dist.init_process_group` starts afresh. The first snippet that raises ends the job (its peers would
wait for it in a collective): rank 0 prints `ok PAGE:LINE` for every snippet that ran and
`FAILED PAGE:LINE` with the traceback for the one that broke, and the job exits 1."""

import json
import os
import sys
import traceback

import torch
import torch.distributed as dist


def run_page(snippets: list) -> None:
    namespace = {"__name__": "__main__"}
    for snippet in snippets:
        where = f"{snippet['doc']}:{snippet['line']}"
        torch.manual_seed(0)  # the ranks start every snippet alike (models made without a broadcast)
        code = compile("\n" * (snippet["line"] - 1) + snippet["code"], snippet["doc"], "exec")
        try:
            exec(code, namespace)
        except BaseException:  # noqa: BLE001  (a snippet's SystemExit is a failure too)
            print(f"FAILED {where} on rank {os.environ.get('RANK', '0')}\n{traceback.format_exc()}", flush=True)
            os._exit(1)  # not sys.exit: the peers are in a collective, and atexit would wait for them
        if dist.is_initialized():
            dist.barrier()  # in step for the next snippet
        if os.environ.get("RANK", "0") == "0":
            print(f"ok {where}", flush=True)


def main(path: str) -> None:
    import torch_chainermn  # noqa: F401  (the pages import it; here so that a broken import is named once)

    pages = {}
    for snippet in json.loads(open(path).read()):
        pages.setdefault(snippet["doc"], []).append(snippet)
    for snippets in pages.values():
        run_page(snippets)
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
