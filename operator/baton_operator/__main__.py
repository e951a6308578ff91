"""``python -m baton_operator``: elect a leader, then run the kopf handlers while leading."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import sys

LEASE_NAME = "baton-operator"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="baton_operator", description=__doc__)
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument("--namespace", action="append", default=[],
                       help="watch this namespace (repeatable)")
    scope.add_argument("--all-namespaces", action="store_true", help="watch every namespace")
    parser.add_argument("--image", default=os.environ.get("BATON_OPERATOR_IMAGE", ""),
                        help="baton image for services that name none (env BATON_OPERATOR_IMAGE)")
    parser.add_argument("--lease-namespace", default=os.environ.get("POD_NAMESPACE", "default"),
                        help="namespace of the leader-election Lease (env POD_NAMESPACE)")
    parser.add_argument("--lease-name", default=LEASE_NAME, help="name of the Lease")
    parser.add_argument("--identity", default=os.environ.get("POD_NAME", socket.gethostname()),
                        help="this replica's name in the Lease (env POD_NAME)")
    parser.add_argument("--lease-duration-s", type=int, default=15,
                        help="a leader silent this long loses the Lease")
    parser.add_argument("--log-level", default="INFO",
                        choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    return parser


def validate(args: argparse.Namespace) -> None:
    if not args.image:
        raise ValueError("--image (or BATON_OPERATOR_IMAGE) is empty: name the baton image")
    if not (args.namespace or args.all_namespaces):
        raise ValueError("give --namespace NAME (repeatable) or --all-namespaces")
    if args.lease_duration_s < 3:
        raise ValueError(f"--lease-duration-s must be >= 3, got {args.lease_duration_s}")


def _api_client():
    import kubernetes

    try:
        kubernetes.config.load_incluster_config()
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config()
    return kubernetes.client.ApiClient()


async def _main(args: argparse.Namespace) -> None:
    import kopf

    from baton_operator.autoscaler import Autoscaler
    from baton_operator.handlers import register
    from baton_operator.kube import Kube
    from baton_operator.leader import LeaseElector, run_as_leader
    from baton_operator.reconcile import Reconciler

    kube = Kube(_api_client())
    registry = kopf.OperatorRegistry()
    register(registry, Reconciler(kube, args.image), Autoscaler(kube))
    # The same credentials as our own client: in-cluster service account, or kubeconfig.
    kopf.on.login(registry=registry)(kopf.login_via_client)
    elector = LeaseElector(kube, args.lease_namespace, args.lease_name, args.identity,
                           args.lease_duration_s)

    async def operate(stop_flag: asyncio.Event) -> None:
        # The Lease already makes this replica the only one acting: no kopf peering.
        await kopf.operator(registry=registry, standalone=True, stop_flag=stop_flag,
                            clusterwide=args.all_namespaces, namespaces=args.namespace)

    await run_as_leader(elector, operate, retry_s=args.lease_duration_s / 3)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        validate(args)
    except ValueError as e:
        print(f"baton_operator: error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(message)s")
    asyncio.run(_main(args))
    return 1  # only reached when leadership was lost: restart as a candidate


if __name__ == "__main__":
    sys.exit(main())
