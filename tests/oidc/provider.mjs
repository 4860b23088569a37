// A real OpenID provider on loopback for tests/test_oidc.py: oidc-provider (an OpenID Certified
// implementation), its own discovery, authorize, token, userinfo and refresh endpoints, with
// a plain login page (user name and password) and a consent page instead of the library's
// development pages, so the hub's login goes through the same forms a person would fill in.
//
// Configured by the environment, all set by the pytest fixture:
//   OIDC_PORT          the port on 127.0.0.1 (the issuer is http://127.0.0.1:<port>)
//   OIDC_CLIENTS       JSON list of clients: [{client_id, client_secret, redirect_uris}]
//   OIDC_USERS         JSON map: name -> {password, groups}
//   OIDC_ACCESS_TTL    seconds an access token lives (short, so a test sees one expire)
//   OIDC_ADMIN_TOKEN   the bearer token of the admin hook below
//
// The admin hook, for tests only: PUT /admin/users/<name> {"groups": [...]} changes a user's
// groups at once (the next userinfo answer carries them); GET /admin/grants counts the token
// endpoint's grants by type (how many refresh_token grants the hub made).
import http from 'node:http';

import Provider from 'oidc-provider';

const port = Number(process.env.OIDC_PORT);
const issuer = `http://127.0.0.1:${port}`;
const clients = JSON.parse(process.env.OIDC_CLIENTS || '[]');
const users = JSON.parse(process.env.OIDC_USERS || '{}');
const accessTtl = Number(process.env.OIDC_ACCESS_TTL || '3600');
const adminToken = process.env.OIDC_ADMIN_TOKEN || '';
const grants = {};

const provider = new Provider(issuer, {
  clients: clients.map(c => ({
    grant_types: ['authorization_code', 'refresh_token'],
    response_types: ['code'],
    token_endpoint_auth_method: 'client_secret_post',
    ...c
  })),
  async findAccount(ctx, id) {
    if (!users[id]) {
      return undefined;
    }
    return {
      accountId: id,
      // read at every call: a change through the admin hook shows in the next userinfo answer
      async claims() {
        const user = users[id];
        return user
          ? {
              sub: id,
              preferred_username: id,
              name: id,
              email: `${id}@example.org`,
              groups: user.groups
            }
          : { sub: id };
      }
    };
  },
  claims: {
    openid: ['sub'],
    profile: ['preferred_username', 'name'],
    email: ['email'],
    groups: ['groups']
  },
  scopes: ['openid', 'profile', 'email', 'groups', 'offline_access'],
  // as Keycloak does: a refresh token for every client allowed the refresh_token grant
  issueRefreshToken: async (ctx, client) => client.grantTypeAllowed('refresh_token'),
  ttl: { AccessToken: accessTtl },
  clockTolerance: 0, // an access token is refused once expired (the default tolerates 15 s more)
  features: { devInteractions: { enabled: false } },
  interactions: { url: (ctx, interaction) => `/interaction/${interaction.uid}` },
  cookies: { keys: ['danlu-oidc-tests-cookie-key'] }
});
provider.on('grant.success', ctx => {
  const type = ctx.oidc.params.grant_type;
  grants[type] = (grants[type] || 0) + 1;
});
provider.on('server_error', (ctx, err) => console.error('server_error', err));

function page(title, body) {
  return `<!doctype html><html><head><title>${title}</title></head><body><h1>${title}</h1>${body}</body></html>`;
}

function escape(text) {
  return String(text).replace(/[&<>"']/g, c => `&#${c.charCodeAt(0)};`);
}

async function formBody(req) {
  let data = '';
  for await (const chunk of req) {
    data += chunk;
  }
  return Object.fromEntries(new URLSearchParams(data));
}

async function jsonBody(req) {
  let data = '';
  for await (const chunk of req) {
    data += chunk;
  }
  return JSON.parse(data || '{}');
}

function send(res, status, body, type = 'text/html; charset=utf-8') {
  res.statusCode = status;
  res.setHeader('Content-Type', type);
  res.end(body);
}

function loginPage(uid, error = '') {
  return page(
    'Sign in to the test provider',
    `${error ? `<p class="error">${escape(error)}</p>` : ''}
<form method="post" action="/interaction/${uid}/login">
  <label>User name <input name="login" autofocus></label>
  <label>Password <input name="password" type="password"></label>
  <button type="submit">Sign in</button>
</form>`
  );
}

async function interaction(req, res, uid, action) {
  const details = await provider.interactionDetails(req, res);
  const { prompt, params, session } = details;
  if (req.method === 'GET') {
    if (prompt.name === 'login') {
      return send(res, 200, loginPage(uid));
    }
    return send(
      res,
      200,
      page(
        'Allow access',
        `<p>${escape(params.client_id)} asks for: ${escape(params.scope)}</p>
<form method="post" action="/interaction/${uid}/confirm"><button type="submit">Allow</button></form>`
      )
    );
  }
  const form = await formBody(req);
  if (action === 'login') {
    const user = users[form.login];
    if (!user || user.password !== form.password) {
      return send(res, 200, loginPage(uid, 'Wrong user name or password.'));
    }
    return provider.interactionFinished(req, res, { login: { accountId: form.login } }, { mergeWithLastSubmission: false });
  }
  if (action === 'confirm') {
    const grant = details.grantId
      ? await provider.Grant.find(details.grantId)
      : new provider.Grant({ accountId: session.accountId, clientId: params.client_id });
    const missing = prompt.details.missingOIDCScope;
    if (missing) {
      grant.addOIDCScope(missing.join(' '));
    }
    if (prompt.details.missingOIDCClaims) {
      grant.addOIDCClaims(prompt.details.missingOIDCClaims);
    }
    const grantId = await grant.save();
    return provider.interactionFinished(req, res, { consent: { grantId } }, { mergeWithLastSubmission: true });
  }
  return send(res, 404, page('Not found', ''));
}

async function admin(req, res, path) {
  if (req.headers.authorization !== `Bearer ${adminToken}`) {
    return send(res, 403, '{"error": "admin token required"}', 'application/json');
  }
  const user = path.match(/^\/admin\/users\/([^/]+)$/);
  if (user && req.method === 'PUT') {
    const name = decodeURIComponent(user[1]);
    if (!users[name]) {
      return send(res, 404, '{"error": "no such user"}', 'application/json');
    }
    users[name].groups = (await jsonBody(req)).groups;
    return send(res, 200, JSON.stringify(users[name].groups), 'application/json');
  }
  if (path === '/admin/grants' && req.method === 'GET') {
    return send(res, 200, JSON.stringify(grants), 'application/json');
  }
  return send(res, 404, '{"error": "not found"}', 'application/json');
}

const handle = provider.callback();
const server = http.createServer(async (req, res) => {
  const path = new URL(req.url, issuer).pathname;
  try {
    const match = path.match(/^\/interaction\/([^/]+)(?:\/(login|confirm))?$/);
    if (match) {
      return await interaction(req, res, match[1], match[2]);
    }
    if (path.startsWith('/admin/')) {
      return await admin(req, res, path);
    }
    return handle(req, res);
  } catch (err) {
    console.error(err);
    return send(res, 500, page('Error', escape(err.message)));
  }
});
server.listen(port, '127.0.0.1', () => console.log(`oidc-provider listening at ${issuer}`));
