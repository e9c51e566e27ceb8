# One image for web, worker, beat and the node agent.
FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app
COPY requirements.txt .
RUN pip install --no-cache-dir -r requirements.txt
COPY . .
RUN pip install --no-cache-dir --no-deps -e . && pip install --no-cache-dir --no-deps -e client \
    && DJANGO_SETTINGS_MODULE=gpushare.settings.dev python manage.py collectstatic --noinput -v 0
RUN useradd --system --uid 1000 gpushare && mkdir -p /app/var && chown gpushare /app/var
USER gpushare
EXPOSE 8000
CMD ["gunicorn", "gpushare.wsgi", "-b", "0.0.0.0:8000", "-w", "3", "--threads", "4"]
