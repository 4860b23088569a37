// Jest for the handler, models and pure helpers (ts-jest, jsdom), on
// JupyterLab's own test configuration (@jupyterlab/testing).
const jestJupyterLab = require('@jupyterlab/testing/lib/jest-config');

// ES modules that Jest must transform (JupyterLab's own list, plus its packages).
const esModules = [
  '@codemirror',
  '@jupyter/',
  '@jupyterlab/',
  '@lumino/',
  '@marijn',
  '@microsoft',
  'color',
  'exenv-es6',
  'lib0',
  'marked',
  'nanoid',
  'vscode-ws-jsonrpc',
  'y-protocols',
  'y-websocket',
  'yjs'
].join('|');

const baseConfig = jestJupyterLab(__dirname);

module.exports = {
  ...baseConfig,
  automock: false,
  reporters: ['default'],
  roots: ['<rootDir>/src'],
  testRegex: 'src/__tests__/.*\\.spec\\.tsx?$',
  transformIgnorePatterns: [`/node_modules/(?!${esModules}).+`]
};
