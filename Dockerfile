# syntax=docker/dockerfile:1
# The trellis image: built in the toolchain's Debian image, run on distroless (glibc and
# libgcc, no shell) as the nonroot user. scripts/build-image assembles the same image
# without pulling a base image. The binary is stripped; its symbols stay in the build stage
# (/trellis.debug: `docker build --target build`, then copy it out).
#   docker build --build-arg TRELLIS_VERSION="$(git describe --always --dirty)" -t trellis .

FROM rust:1.95.0-bookworm AS build
# Baked into the binary (`trellis --version`); the crate version when empty.
ARG TRELLIS_VERSION=""
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    if [ -z "$TRELLIS_VERSION" ]; then unset TRELLIS_VERSION; fi \
    && cargo build --release --locked \
    && objcopy --only-keep-debug target/release/trellis /trellis.debug \
    && install -m 0755 target/release/trellis /trellis \
    && objcopy --strip-all --add-gnu-debuglink=/trellis.debug /trellis

FROM gcr.io/distroless/cc-debian12:nonroot
ARG TRELLIS_VERSION=""
ARG TRELLIS_SOURCE=""
LABEL org.opencontainers.image.title="trellis" \
      org.opencontainers.image.version="$TRELLIS_VERSION" \
      org.opencontainers.image.source="$TRELLIS_SOURCE"
COPY --from=build /trellis /usr/local/bin/trellis
USER 65532:65532
WORKDIR /
ENTRYPOINT ["/usr/local/bin/trellis"]
