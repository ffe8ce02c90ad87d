from django.urls import path

from . import accounts, billing, instances, providers, renters

urlpatterns = [
    path("", accounts.home, name="home"),
    path("accounts/login/", accounts.EmailLoginView.as_view(), name="login"),
    path("accounts/logout/", accounts.logout_view, name="logout"),
    path("accounts/signup/", accounts.signup, name="signup"),
    path("accounts/confirm/<str:token>/", accounts.signup_confirm, name="signup-confirm"),
    path("account/ssh-keys/", accounts.ssh_keys, name="ssh-keys"),
    path("account/ssh-keys/<int:pk>/delete/", accounts.ssh_key_delete, name="ssh-key-delete"),
    path("account/api-keys/", accounts.api_keys, name="api-keys"),
    path("account/api-keys/<int:pk>/revoke/", accounts.api_key_revoke, name="api-key-revoke"),
    # Renters
    path("offers/", renters.offers, name="offers"),
    path("offers/<int:node_id>/rent/", renters.rent, name="rent"),
    path("gpus/", renters.gpu_compare, name="gpu-compare"),
    path("instances/", instances.instances, name="instances"),
    path("instances/<int:pk>/", instances.instance, name="instance"),
    path("instances/<int:pk>/live/", instances.instance_live, name="instance-live"),
    path("instances/<int:pk>/<slug:verb>/", instances.instance_verb, name="instance-verb"),
    # Providers
    path("nodes/", providers.nodes, name="nodes"),
    path("nodes/new/", providers.node_register, name="node-register"),
    path("nodes/<int:pk>/", providers.node, name="node"),
    path("nodes/<int:pk>/live/", providers.node_live, name="node-live"),
    path("nodes/<int:pk>/verify/", providers.node_verify, name="node-verify"),
    path("nodes/<int:pk>/settings/", providers.node_settings, name="node-settings"),
    path("nodes/<int:pk>/retire/", providers.node_retire, name="node-retire"),
    # Money: named as in marketplace/templatetags/marketplace_web.py BILLING_NAV, so the navigation shows them.
    path("account/balance/", billing.balance, name="web-balance"),
    path("account/balance/live/", billing.balance_live, name="web-balance-live"),
    path("account/balance/top-up/", billing.top_up, name="web-top-up"),
    path("account/cards/add/", billing.card_add, name="web-card-add"),
    path("account/cards/<int:pk>/remove/", billing.card_remove, name="web-card-remove"),
    path("account/usage/", billing.usage, name="web-usage"),
    path("account/statements/", billing.statements, name="web-statements"),
    path("account/statements/<str:month>/", billing.statement, name="web-statement"),
    path("earnings/", billing.earnings, name="web-earnings"),
    path("payouts/", billing.payouts_page, name="web-payouts"),
]
