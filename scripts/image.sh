#!/usr/bin/env bash
# Build baton's image, and check it by running baton inside it (docs/operations.md,
# "Building the image").
#
#   scripts/image.sh build   `make image`: docker when a daemon answers, else buildah
#   scripts/image.sh check   `make image-check`: build with buildah and run inside the image
#                            `baton --help`, `baton generate --json`, the operator's --help
#                            and `baton up --demo` with a read-only root filesystem
#
# Settings (environment; `make image VAR=...` passes them):
#   IMAGE            tag to build                        (default baton:0.1.0; check: baton:check)
#   BASE_IMAGE       base image                          (default: the Dockerfile's,
#                    python:3.11-slim-bookworm; check: that if it can be pulled, else a Debian
#                    bookworm made by debootstrap, tagged localhost/baton-base:bookworm)
#   TORCH_INDEX_URL  index for torch                     (default: the Dockerfile's, the CPU one)
#   TORCH_WHEELS     directory holding the torch wheel   (default none; check: /opt/wheels when
#                    it holds one); buildah mounts it into the build, docker cannot
#   NIXL             1 = add NIXL, the KV data plane for RDMA clusters (default: the Dockerfile's, 0)
#
# buildah runs with vfs storage and chroot isolation: no overlay mounts, no user namespaces,
# no daemon, which is what a machine without Docker (or inside a container) allows.
# BUILDAH_STORAGE_DRIVER=overlay is faster and smaller where the kernel allows overlay mounts.
set -euo pipefail

cd "$(dirname "$0")/.."
STORAGE=${BUILDAH_STORAGE_DRIVER:-vfs}
# Every buildah call below goes through this; buildah 1.28 ignores $STORAGE_DRIVER.
buildah() { command buildah --storage-driver "$STORAGE" "$@"; }
TORCH_VERSION=$(sed -n 's/^ARG TORCH_VERSION=//p' Dockerfile)
DEFAULT_BASE=$(sed -n 's/^ARG BASE_IMAGE=//p' Dockerfile)
DEBOOTSTRAP_BASE=localhost/baton-base:bookworm
WHEELS_MOUNT=/mnt  # where the build sees TORCH_WHEELS: exists in Debian bases, stays empty

say() { printf '\n== %s\n' "$*" >&2; }
die() { printf 'image.sh: %s\n' "$*" >&2; exit 1; }

docker_answers() { command -v docker >/dev/null && docker info >/dev/null 2>&1; }

# Build arguments shared by both builders; an unset setting keeps the Dockerfile's default.
build_args() {
    [ -z "${BASE_IMAGE:-}" ] || echo "--build-arg BASE_IMAGE=$BASE_IMAGE"
    [ -z "${TORCH_INDEX_URL:-}" ] || echo "--build-arg TORCH_INDEX_URL=$TORCH_INDEX_URL"
    [ -z "${TORCH_WHEELS:-}" ] || echo "--build-arg TORCH_FIND_LINKS=$WHEELS_MOUNT"
    [ -z "${NIXL:-}" ] || echo "--build-arg NIXL=$NIXL"
}

build_with_buildah() {
    local mounts=() pip_trust rc=0
    if [ -n "${TORCH_WHEELS:-}" ]; then
        [ -d "$TORCH_WHEELS" ] || die "TORCH_WHEELS=$TORCH_WHEELS is not a directory"
        mounts+=(--volume "$(realpath "$TORCH_WHEELS"):$WHEELS_MOUNT:ro")
    fi
    # pip in the build trusts the CAs this (Debian) machine trusts, through a site pip.conf
    # mounted for the build only (not in the image): where HTTPS goes through a proxy that
    # re-signs it, the base image's own CA bundle rejects PyPI.
    pip_trust=$(mktemp -d)
    if [ -f /etc/ssl/certs/ca-certificates.crt ]; then
        cp /etc/ssl/certs/ca-certificates.crt "$pip_trust/ca.crt"
        printf '[global]\ncert = /etc/xdg/pip/ca.crt\n' >"$pip_trust/pip.conf"
        mounts+=(--volume "$pip_trust:/etc/xdg/pip:ro")
    fi
    # --pull=missing: a local base (the debootstrap one) is used as is, a remote one fetched once.
    # --layers=false: one layer over the base; vfs storage copies every layer whole.
    # shellcheck disable=SC2046  # build_args prints whole words
    buildah build --isolation chroot --pull=missing --layers=false --force-rm "${mounts[@]}" \
        $(build_args) -t "$IMAGE" . || rc=$?
    rm -rf "$pip_trust"
    return "$rc"
}

build() {
    IMAGE=${IMAGE:-baton:0.1.0}
    if docker_answers; then
        [ -z "${TORCH_WHEELS:-}" ] \
            || die "docker build cannot mount TORCH_WHEELS: give TORCH_INDEX_URL, or use buildah"
        say "docker build -t $IMAGE"
        # shellcheck disable=SC2046
        docker build $(build_args) -t "$IMAGE" .
    else
        command -v buildah >/dev/null || die "no Docker daemon, no buildah: apt-get install buildah"
        say "no Docker daemon: buildah build -t $IMAGE ($STORAGE storage, chroot isolation)"
        build_with_buildah || die "buildah build failed; if no registry answers,
  \`make image-check\` makes a Debian base with debootstrap: then BASE_IMAGE=$DEBOOTSTRAP_BASE"
    fi
}

# A Debian bookworm base made by debootstrap, for when no registry image can be pulled. It has
# no Python; the Dockerfile installs Debian's python3 and python3-venv into it (3.11 on bookworm).
make_debootstrap_base() {
    if buildah inspect --type image "$DEBOOTSTRAP_BASE" >/dev/null 2>&1; then
        say "reusing $DEBOOTSTRAP_BASE"
        return
    fi
    command -v debootstrap >/dev/null || die "debootstrap is missing: apt-get install debootstrap"
    local rootfs container mountpoint
    rootfs=$(mktemp -d /var/tmp/baton-rootfs.XXXXXX)
    say "debootstrap bookworm into $rootfs"
    debootstrap --variant=minbase bookworm "$rootfs" http://deb.debian.org/debian >&2
    # Security and point-release updates, as the Debian images on registries have.
    cat >"$rootfs/etc/apt/sources.list" <<'SOURCES'
deb http://deb.debian.org/debian bookworm main
deb http://deb.debian.org/debian bookworm-updates main
deb http://deb.debian.org/debian-security bookworm-security main
SOURCES
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
    # buildah cannot import a directory; copy it into an empty container and commit that.
    container=$(buildah from scratch)
    mountpoint=$(buildah mount "$container")
    cp -a "$rootfs/." "$mountpoint/"
    buildah umount "$container" >/dev/null
    buildah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
        --cmd /bin/bash "$container"
    buildah commit --rm "$container" "$DEBOOTSTRAP_BASE" >/dev/null
    rm -rf "$rootfs"
}

# The base for the check: the Dockerfile's own when a registry answers, else debootstrap's.
choose_check_base() {
    if [ -n "${BASE_IMAGE:-}" ]; then return; fi
    say "trying to pull $DEFAULT_BASE"
    if timeout 120 command buildah --storage-driver "$STORAGE" pull \
            "docker.io/library/$DEFAULT_BASE" >&2; then
        BASE_IMAGE=docker.io/library/$DEFAULT_BASE
    else
        say "no registry image: making a Debian base with debootstrap"
        make_debootstrap_base
        BASE_IMAGE=$DEBOOTSTRAP_BASE
    fi
}

# The summary: per command run inside the image, its status, seconds and the lines of its
# output (matching SHOW, an extended regex) that say it worked; the last line when it failed.
SUMMARY=()
record() {  # record NAME LOG RC SECONDS SHOW
    local status=ok shown
    shown=$(grep -E "$5" "$2" | cut -c1-110 | sed 's/^/        | /' || true)
    if [ "$3" != 0 ]; then
        status=FAIL
        shown=$(tail -n 1 "$2" | cut -c1-110 | sed "s/^/        | exit $3: /")
    fi
    SUMMARY+=("$(printf '%-4s %3ss  %s\n%s' "$status" "$4" "$1" "$shown")")
}

run_inside() {  # run_inside NAME SHOW COMMAND... : buildah run as the image's user, logged
    local name=$1 show=$2 log start rc=0
    shift 2
    log=$LOGS/$(echo "$name" | tr -c 'a-z0-9\n' '-').log
    say "$name"
    start=$SECONDS
    buildah run --isolation chroot "$CONTAINER" -- "$@" 2>&1 | tee "$log" >&2 \
        || rc=${PIPESTATUS[0]}
    record "$name" "$log" "$rc" $((SECONDS - start)) "$show"
}

# `buildah run` has no read-only root, so this mounts the image's root filesystem itself: in
# a private mount, PID and network namespace, binds it onto itself read-only, puts proc, /dev
# and a tmpfs /tmp ($HOME) on top, then chroots as the image's user with the image's
# environment. The mounts live and die with the namespace; outside it the rootfs is unchanged.
# The network namespace has only loopback, like a pod that reaches nothing; `baton up` binds
# its fixed ports there without clashing with anything on this machine.
# shellcheck disable=SC2016  # expanded by the inner shell
READ_ONLY_VIEW='
    rootfs=$1 user=$2 workdir=$3 command=$4; shift 4
    ip link set lo up
    mount --bind "$rootfs" "$rootfs"
    mount -o remount,bind,ro "$rootfs"
    mount -t proc proc "$rootfs/proc"
    mount --rbind /dev "$rootfs/dev"
    mount -t tmpfs -o mode=1777,size=2g tmpfs "$rootfs/tmp"
    # Prove the view read-only while still root (whom only a read-only mount stops), then,
    # as the image user, that /tmp takes writes; say who runs, then run the command.
    if touch "$rootfs$workdir/.written" 2>/dev/null; then echo "root is WRITABLE"; exit 1; fi
    exec chroot --userspec="$user" "$rootfs" /usr/bin/env -i "$@" /bin/sh -c "
        cd $workdir && touch /tmp/.written || exit 1
        echo \"root read-only (to uid 0 too), /tmp writable; as \$(id -un) (\$(id -u):\$(id -g))\"
        exec $command"
'

run_read_only() {  # run_read_only NAME SHOW COMMAND
    local name=$1 show=$2 command=$3 log start rc=0 rootfs user workdir environment
    log=$LOGS/baton-up-read-only.log
    rootfs=$(buildah mount "$CONTAINER")
    user=$(buildah inspect --format '{{.OCIv1.Config.User}}' "$CONTAINER")
    workdir=$(buildah inspect --format '{{.OCIv1.Config.WorkingDir}}' "$CONTAINER")
    mapfile -t environment < <(buildah inspect \
        --format '{{range .OCIv1.Config.Env}}{{println .}}{{end}}' "$CONTAINER" | sed '/^$/d')
    say "$name"
    start=$SECONDS
    unshare --mount --pid --net --fork --propagation private -- \
        bash -euc "$READ_ONLY_VIEW" _ "$rootfs" "$user" "$workdir" "$command" "${environment[@]}" \
        2>&1 | tee "$log" >&2 || rc=${PIPESTATUS[0]}
    buildah umount "$CONTAINER" >/dev/null
    record "$name" "$log" "$rc" $((SECONDS - start)) "$show"
}

check() {
    IMAGE=${IMAGE:-baton:check}
    command -v buildah >/dev/null || die "buildah is missing: apt-get install buildah"
    # torch's CPU wheel lies in /opt/wheels on the development machines (as for `make setup`).
    if [ -z "${TORCH_WHEELS:-}" ] && compgen -G "/opt/wheels/torch-$TORCH_VERSION*.whl" >/dev/null
    then TORCH_WHEELS=/opt/wheels; fi
    LOGS=$(mktemp -d /tmp/baton-image-check.XXXXXX)
    choose_check_base
    say "buildah build -t $IMAGE on $BASE_IMAGE, torch from ${TORCH_WHEELS:-the index}"
    local start=$SECONDS
    build_with_buildah 2>&1 | tee "$LOGS/build.log" >&2
    local build_s=$((SECONDS - start))

    CONTAINER=$(buildah from --pull=never "$IMAGE")
    trap 'buildah rm "$CONTAINER" >/dev/null' EXIT
    local user
    # shellcheck disable=SC2016  # expanded inside the image
    user=$(buildah run --isolation chroot "$CONTAINER" -- \
        sh -c 'echo "$(id -un) ($(id -u):$(id -g))"')

    run_inside "baton --help" '^usage:' baton --help
    run_inside "baton generate --json --max-tokens 16 'def fibonacci(n):'" '^\{' \
        baton generate --json --max-tokens 16 "def fibonacci(n):"
    run_inside "python -m baton_operator --help" '^usage:' python -m baton_operator --help
    run_read_only "baton up --demo --exit-after-demo  (read-only root, tmpfs /tmp, loopback)" \
        '^root read-only|^baton is up|^--- TTFT|^=== OpenAI API' "baton up --demo --exit-after-demo"

    printf '\n== baton image check\n'
    printf 'image     %s, %s, built in %ss on %s (torch from %s)\n' "$IMAGE" \
        "$(buildah images --format '{{.Size}}' "$IMAGE" | head -n 1)" "$build_s" "$BASE_IMAGE" \
        "${TORCH_WHEELS:-the index}"
    printf 'user      %s\n' "$user"
    printf 'logs      %s\n' "$LOGS"
    printf '%s\n' "${SUMMARY[@]}"
    ! printf '%s\n' "${SUMMARY[@]}" | grep -q '^FAIL '
}

case "${1:-}" in
    build) build ;;
    check) check ;;
    *) die "usage: scripts/image.sh build|check" ;;
esac
