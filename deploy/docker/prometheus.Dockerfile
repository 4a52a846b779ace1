# Prometheus for compose: Debian's prometheus binary (the package the setup
# installs: scripts/install-prometheus.sh) on the locally made base, run as
# nobody. scripts/build-images.sh stages the context (.build/prometheus).
ARG BASE_IMAGE=gpupool/base:bookworm
FROM ${BASE_IMAGE}
ARG PROMETHEUS_VERSION
LABEL org.opencontainers.image.title="prometheus (gpupool)" \
      org.opencontainers.image.version="${PROMETHEUS_VERSION}"
COPY prometheus /usr/bin/prometheus
RUN install -d -o 65534 -g 65534 /prometheus
USER 65534:65534
EXPOSE 9090
ENTRYPOINT ["/usr/bin/prometheus"]
