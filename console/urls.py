from django.urls import path

from . import views

app_name = "console"

urlpatterns = [
    path("", views.index, name="index"),
    path("fleet/", views.fleet, name="fleet"),
    path("fleet/nodes/<int:pk>/<slug:action>/", views.node_action, name="node-action"),
    path("fleet/gpus/<int:pk>/return/", views.gpu_return, name="gpu-return"),
    path("queue/", views.queue, name="queue"),
    path("queue/<int:pk>/cancel/", views.job_cancel, name="job-cancel"),
    path("queue/<int:pk>/class/", views.job_reclass, name="job-reclass"),
]
urlpatterns += [
    path("rules/", views.rules, name="rules"),
    path("rules/previews/<int:pk>/", views.whatif_run, name="whatif-run"),
    path("reports/", views.reports, name="reports"),
]
