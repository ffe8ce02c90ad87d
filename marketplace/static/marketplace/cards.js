/* Saving a card with Stripe Elements (loaded only with a real publishable key, after Stripe.js).
 * The browser asks this site for a SetupIntent (POST /api/v1/billing/cards/setup-intent/, the session's CSRF
 * token), confirms it with Stripe using the card field, then submits the SetupIntent's id in the page's form;
 * the server saves the card the SetupIntent confirmed. The card number never reaches this site.
 */
(function () {
  "use strict";
  document.addEventListener("DOMContentLoaded", function () {
    var form = document.getElementById("elements-form");
    if (!form || typeof window.Stripe !== "function") return;
    var stripe = window.Stripe(form.getAttribute("data-publishable-key"));
    var card = stripe.elements().create("card");
    card.mount("#card-element");
    var status = document.getElementById("card-status");
    var button = form.querySelector("button[type=submit]");
    form.addEventListener("submit", function (event) {
      event.preventDefault();
      status.textContent = "";
      button.disabled = true;
      var csrf = form.querySelector("[name=csrfmiddlewaretoken]").value;
      fetch(form.getAttribute("data-setup-url"), {
        method: "POST", credentials: "same-origin", headers: { "X-CSRFToken": csrf, "Accept": "application/json" }
      }).then(function (response) {
        return response.json().then(function (body) {
          if (!response.ok) throw new Error(body.detail || "The card form could not start; try again.");
          return stripe.confirmCardSetup(body.client_secret, { payment_method: { card: card } });
        });
      }).then(function (result) {
        if (result.error) throw new Error(result.error.message);
        form.querySelector("[name=setup_intent]").value = result.setupIntent.id;
        form.submit();
      }).catch(function (error) {
        status.textContent = error.message;
        button.disabled = false;
      });
    });
  });
})();
