# syntax=docker/dockerfile:1
# Build stage: the Rust toolchain and libvirt headers for the `virt` crate.
FROM rust:1.95-bookworm AS build
RUN apt-get update \
 && apt-get install -y --no-install-recommends pkg-config libvirt-dev \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY Cargo.toml Cargo.lock build.rs ./
COPY machines machines
COPY src src
RUN cargo build --release --locked --bin egress-proxies-operator

# Runtime stage: libvirt client libraries and the tools the kvm providers call (virsh,
# qemu-img, genisoimage, ssh for qemu+ssh URIs). Runs as a non-root user.
FROM debian:bookworm-slim
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates libvirt0 libvirt-clients qemu-utils \
        genisoimage openssh-client \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /src/target/release/egress-proxies-operator /usr/local/bin/egress-proxies-operator
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/egress-proxies-operator"]
