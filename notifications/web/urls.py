from django.urls import path

from . import views

urlpatterns = [
    path("", views.notifications, name="notifications"),
    path("<int:pk>/read/", views.notification_read, name="notification-read"),
    path("read-all/", views.notifications_read_all, name="notifications-read-all"),
    path("settings/", views.notification_settings, name="notification-settings"),
    path("unsubscribe/<str:token>/", views.unsubscribe, name="notification-unsubscribe"),
    path("webhooks/<int:pk>/", views.endpoint, name="notification-endpoint"),
    path("webhooks/<int:pk>/test/", views.endpoint_test, name="notification-endpoint-test"),
    path("webhooks/<int:pk>/toggle/", views.endpoint_toggle, name="notification-endpoint-toggle"),
    path("webhooks/<int:pk>/delete/", views.endpoint_delete, name="notification-endpoint-delete"),
]
