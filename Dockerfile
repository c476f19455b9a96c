# compactproxy container: a static binary on distroless, non-root, configured
# by COMPACTPROXY_* environment variables alone (no config file in the image).
#
#   docker build -t compactproxy .
#   docker run --rm -p 8081:8081 -e COMPACTPROXY_UPSTREAM_URL=https://api.openai.com/v1 \
#     -e COMPACTPROXY_UPSTREAM_API_KEY -e COMPACTPROXY_AUTH_CLIENT_KEYS compactproxy

FROM golang:1.26 AS build
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
ARG VERSION=dev
RUN CGO_ENABLED=0 go build -trimpath -ldflags "-s -w -X main.version=${VERSION}" \
      -o /out/compactproxy ./cmd/compactproxy && mkdir -p /out/data

FROM gcr.io/distroless/static-debian12:nonroot
COPY --from=build /out/compactproxy /compactproxy
# /data owned by nonroot (distroless has no shell to mkdir/chown at run time).
COPY --from=build --chown=nonroot:nonroot /out/data /data
USER nonroot:nonroot
# Listen on all interfaces inside the container: the binary's own default is
# 127.0.0.1:8081, which a published port or a Service cannot reach.
ENV COMPACTPROXY_LISTEN=:8081
# store.backend bolt keeps its file here; mount a volume to keep summaries
# across container restarts (COMPACTPROXY_STORE_BACKEND=bolt).
ENV COMPACTPROXY_STORE_BOLT_PATH=/data/compactproxy.db
VOLUME /data
EXPOSE 8081
# Exec form: distroless has no shell. healthcheck GETs http://127.0.0.1:8081/healthz.
HEALTHCHECK --interval=15s --timeout=3s --start-period=5s --retries=3 \
  CMD ["/compactproxy", "healthcheck"]
ENTRYPOINT ["/compactproxy"]
