# batchgen worker image. On a GPU host: docker compose up (see docker-compose.yml).
FROM python:3.11-slim

# Triton builds a small launcher with the system C compiler the first time it runs.
RUN apt-get update \
    && apt-get install -y --no-install-recommends build-essential \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /app
# PyPI's linux x86_64 torch wheel is the CUDA build; override for another one.
ARG TORCH="torch==2.13.0"
RUN pip install --no-cache-dir "${TORCH}"

COPY pyproject.toml README.md ./
COPY batchgen batchgen
COPY worker worker
COPY kernels kernels
COPY jobs jobs
RUN pip install --no-cache-dir .

ENV BATCHGEN_HOME=/var/lib/batchgen
ENTRYPOINT ["batchgen"]
CMD ["--help"]
