"""The list of subcommand registrars; each takes the argparse subparsers object and adds its commands."""
from __future__ import annotations


def _generate(sub):
    from specdecode.engine.cli import register
    register(sub)


def _chat(sub):
    from specdecode.engine.chat import register
    register(sub)


def _models(sub):
    from specdecode.models.cli import register
    register(sub)


def _train(sub):
    from specdecode.train.cli import register
    register(sub)


def _serve(sub):
    from specdecode.server.cli import register
    register(sub)


def _datastore(sub):
    from specdecode.spec.datastore import register
    register(sub)


def _bench(sub):
    from specdecode.bench.cli import register
    register(sub)


def _plan(sub):
    from specdecode.plan import register
    register(sub)


def _certify(sub):
    from specdecode.certify.cli import register
    register(sub)


REGISTRY = [_generate, _chat, _serve, _models, _train, _bench, _datastore, _plan, _certify]
